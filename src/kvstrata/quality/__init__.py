"""Quality measurements: perplexity and greedy agreement against the exact cache, and
needle retrieval."""

"""Query-aware key selection: the selector (summaries, page choice per step, stats),
page scoring, summaries shared along a common prefix, and attention over the chosen
pages."""

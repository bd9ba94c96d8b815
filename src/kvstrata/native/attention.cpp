// kvstrata decode attention over tiered runs (filled in below).

"""The cache tiers: SSD cold tier, restore verification, write-behind, checkpoints of untrimmable caches."""

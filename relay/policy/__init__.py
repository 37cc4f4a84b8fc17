"""Pure decisions that take host facts as values: the filesystem plan, the egress policy, tiers, the deny list."""

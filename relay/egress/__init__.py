"""The host-side proxy and what it needs: the allowlist decision, live rules (control), the secrets it injects, the decision log."""

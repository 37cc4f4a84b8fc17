"""Everything that reads or writes what a box produced: the janitor, guarded settings, agent state, the git dir, the staged workdir and its apply, placeholders, logins."""

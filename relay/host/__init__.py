"""How code touches this host: safefs (the one way to touch a path a box could have written), where things live, process liveness, and the probes of what this host can enforce."""

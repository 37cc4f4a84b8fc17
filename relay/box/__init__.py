"""What runs inside a box, or sets one up from outside: job control, Landlock, link pinning, the overlay mount, resource limits, the escape probes."""

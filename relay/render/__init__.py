"""Plans rendered for the mechanisms: bubblewrap argv, podman argv, seccomp BPF and OCI profiles, the CLIs' own permissions."""

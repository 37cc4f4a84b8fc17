"""The runners, one per mode and tier: local (bwrap, process), container (podman), kube, vm; and the images they need."""

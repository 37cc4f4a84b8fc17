"""The staged layer's value and its pure checks: the mount's options, which paths its option string
can carry, and which kernel defaults the review cannot read past.

Split from relay/box/overlay.py, the mount itself, because the plan and the container runner need
only these, and the mount's ctypes (~2.5 ms to import) belongs to the tiers that fork into it.
"""

from __future__ import annotations

import os

from relay.model.record import record

# Overlay option syntax: ',' separates options, ':' lower layers, '\\' escapes; '=' would split the key.
UNSAFE_CHARS = ",:\\="


@record
class Layer:
    """One staged run's mount: `lower` (the checkout, real path), `upper` and `work` (owner-only,
    hive relay's state dir), mounted at `lower` itself."""

    lower: str
    upper: str
    work: str

    def options(self, userns: bool) -> str:
        opts = [f"lowerdir={self.lower}", f"upperdir={self.upper}", f"workdir={self.work}",
                "metacopy=off", "index=off", "xino=off"]
        # In a user namespace the kernel takes only `nofollow` (redirects neither made nor followed).
        opts += ["redirect_dir=nofollow", "userxattr"] if userns else ["redirect_dir=off"]
        return ",".join(opts)


PARAMS = "/sys/module/overlay/parameters"


def kernel_defaults_on(params: str = PARAMS) -> list[str]:
    """The overlay features the kernel turns on by default that the review cannot read from the
    upper layer alone (a metacopy file's data and a redirected directory's content are in the
    lower layer). An engine's mount (podman's `:O`) passes no option for them, so these hold."""
    on = []
    for name in ("metacopy", "redirect_dir"):
        try:
            with open(os.path.join(params, name)) as fh:
                if fh.read().strip() in ("Y", "y", "1", "on"):
                    on.append(name)
        except OSError:
            continue  # no such parameter (the module is built without the feature, or not loaded yet)
    return on


def unsafe_path(path: str) -> str | None:
    """The character of `path` that the overlay option string cannot carry; None when it can."""
    return next((c for c in path if c in UNSAFE_CHARS), None)

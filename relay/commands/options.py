"""The options of `contribute-hive`, one table for both entries: names, short flags, value
placeholders and help texts. relay/commands/cli.py builds argparse from it, tasks.py feeds invoke from it,
relay/commands/completion.py writes the shell completions from it, and tests/test_surface.py compares the two
help outputs option by option. Data only, so every one of them can import it."""

from __future__ import annotations

from relay.model.refusal import ENTRY

# One source of truth for both entries (`invoke contribute-hive` and bin/contribute-hive / hive-relay /
# `python -m relay`): names, short flags, value placeholders and help texts. tasks.py feeds invoke from it,
# build_parser() feeds argparse, and tests/test_surface.py compares the two help outputs option by option.
ALLOW_HOST_HELP = ("extra egress host, repeatable: NAME[:PORT], *.DOMAIN[:PORT] (its subdomains, not the domain "
                   "itself) or NAME[:PORT]=ADDR:PORT (pinned to that address); a NAME without a port means 443 "
                   "(HTTPS); plain HTTP needs the port: NAME:80")
HELP = {
    "backend": "agent CLI: claude, codex, gemini, opencode or shell (also the first positional)",
    "mode": "local (bubblewrap box, default), container (podman/docker) or kube (Kubernetes objects) (also the "
            "second positional)",
    "count": "kube mode: how many boxes to run (an Indexed Job of COUNT completions; default 1)",
    "parallel": "kube mode: how many boxes run at once (default: all of --count)",
    "profile": "policy profile: agent or default; unset picks agent when this host can enforce it",
    "isolation": "auto, process, supervised, gvisor, container or vm; an explicit choice is never downgraded",
    "prompt": "run non-interactively with this prompt (claude -p, codex exec, ...); exit code passes through",
    "workdir": "the checkout to work in (default: current dir); the only host dir the box can write",
    "allow_host": ALLOW_HOST_HELP,
    "allow_preset": ("egress preset, repeatable: the hosts of one ecosystem's registry (npm, pypi, crates, go, "
                     "apt, github-read, or one named under `presets:` in your user config); --dry-run shows them"),
    "ask": (f"when the box is denied a host, hold the request (up to 30 s) and ask `{ENTRY} ask` in a second "
            "terminal; with nobody asking, it is denied at once as usual"),
    "allow_socket": ("bind this host socket into the box and allow AF_UNIX sockets there, repeatable: ssh-agent "
                     "($SSH_AUTH_SOCK), gpg-agent, or an absolute PATH to a socket you own"),
    "allow_ssh": ("let ssh (git over ssh) reach HOST[:PORT] (port 22 unless given) through the egress proxy, "
                  "repeatable; pair it with --allow-socket ssh-agent for your keys"),
    "inspect": ("terminate TLS to this allowed host on the host, for this run, repeatable: HOST[:PORT] (443 unless "
                "given); a per-run CA the box trusts mints its leaf, the proxy sees the HTTP (Host must match, "
                "method/path rules, the secret scan, a route's key added there only); HTTP/1.1 only"),
    "timeout": "seconds before a --prompt or `-- CMD` run is killed (exit 124); interactive sessions have none",
    "no_grants": ("use none of the `auth:` grants of your user config in this run (their secrets are not "
                  "read); --dry-run lists which grants apply and why the others do not"),
    "staged": ("the default: the box's writes to the workdir land in a private copy-on-write layer, never in the "
               "checkout; review and apply them from the host: `hive-relay changes|diff|apply|discard RUN` "
               "(given explicitly, it overrides `workdir: live` in your user config)"),
    "apply": ("staged runs: when the box ends, apply its changes that are not flagged (conflicts and flagged "
              "entries stay staged for review)"),
    "live": ("let the box write the checkout directly, as before staging (files it plants there can run when you "
             "next build or commit); `workdir: live` in your user config makes it the default"),
    "shared_live": ("with --live: start even though another live box runs on this checkout (two live boxes "
                    "overwrite each other's git index and see each other's placeholders; staged boxes share "
                    "a checkout safely)"),
    "vm_accel": ("with --isolation vm: kvm (the default) or tcg (qemu emulates the CPU: the same boundary, about "
                 "16-37 s a boot; for hosts whose KVM cannot boot the guest); `vm: {accel: tcg}` in your user config "
                 "sets it"),
    "dry_run": "print the resolved plan and launch nothing",
    "json": "with --dry-run: print the plan as JSON",
    "quiet": "no banner (notes and refusals are still printed)",
    "version": "print the version (hive-relay X.Y.Z) and exit",
}
# (dest, short flag, value placeholder or None for a switch). Both entries (invoke's task and the `hive-relay`
# parser) take the short flags from here; they are public surface: append new options, never reassign a letter.
OPTIONS = (
    ("allow_host", "a", "HOST[:PORT]"),
    ("backend", "b", "BACKEND"),
    ("count", "c", "N"),
    ("dry_run", "d", None),
    ("isolation", "i", "ISOLATION"),
    ("json", "j", None),
    ("mode", "m", "MODE"),
    ("parallel", "k", "K"),
    ("profile", "p", "PROFILE"),
    ("quiet", "q", None),
    ("prompt", "r", "PROMPT"),
    ("timeout", "t", "SECONDS"),
    ("version", "v", None),
    ("workdir", "w", "DIR"),
    ("allow_socket", "l", "SOCKET"),
    ("allow_ssh", "o", "HOST[:PORT]"),
    ("allow_preset", "e", "PRESET"),
    ("ask", "s", None),
    ("no_grants", "g", None),
    ("staged", "z", None),
    ("apply", "y", None),
    ("live", "L", None),
    ("shared_live", "S", None),
    ("vm_accel", "V", "ACCEL"),
    ("inspect", "I", "HOST[:PORT]"),
)
SHORT_FLAGS = {dest: short for dest, short, _ in OPTIONS}  # invoke's task takes them from here too (tasks.py)
REPEATABLE = ("allow_host", "allow_socket", "allow_ssh", "allow_preset", "inspect")
METAVARS = {dest: meta for dest, _, meta in OPTIONS if meta}
DESCRIPTION = "Run a coding agent inside the hive relay box: BACKEND [local|container] [options] [-- CMD ARGS...]"
COMMAND_HELP = ("-- CMD ARGS...: shell backend only: run CMD with ARGS in the box, each argument passed as is "
                "(no shell string to quote); its exit code passes through")
TERMS = ("the banner's words: supervised = a bubblewrap box (every namespace, seccomp, Landlock, the host-side "
         "egress proxy); process = Landlock and seccomp only, no network; container = podman; vm = a microVM; "
         "profile NAME (DIGEST) = the policy the box enforces, DIGEST its hash (the same digest is the same policy); "
         "staged/live = where the box's writes to the workdir land")
EPILOG = "exit codes: the agent's own; 2 usage/config; 3 refused (unenforceable or opt-in missing); 124 timeout; 128+N signal"
HELP_FIX = "`contribute-hive --help` (or `invoke --help contribute-hive`) lists the options"


def flag_name(dest: str) -> str:
    return "--" + dest.replace("_", "-")

"""The user commands (the only layer that parses arguments): the `python -m relay` entry, doctor, selftest, clean, login, completion."""

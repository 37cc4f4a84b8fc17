"""The frozen types, vocabularies, errors and pure tables everything else is made of. No I/O, no imports from any other layer."""

"""The parts of the typed config below train.py's schema (config.py, which imports them; never the reverse): the
sections of a run's config, each a dataclass that checks its own values (sections), the checks across its keys
(checks), the wording of their one-line errors and of a value on the command line (messages), and what Hydra's
composition of config/*.yaml takes and gives back: the schemas' registration, the command line as Hydra reads it, and
its failures as one line (composition)."""

"""What a run writes and reads back, through storage.py's safe writes: checkpoints (checkpoint: writing them and the
run's checkpoint directories; checkpoint_parts: the stateful parts they are made of; checkpoint_loading: reading
them back on any mesh), the run directory's lock (run_lock), and the caches of tokenized examples (tokenized) and
reference log-probs (reference_cache)."""

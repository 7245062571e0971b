"""The training loop's parts besides the loop itself (trainers.py): the checkpoints it asks for (checkpointer), the
model cards of its exports (model_card), what it logs (run_log), and stopping on a signal (stop_signals)."""

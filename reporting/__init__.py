"""What a run tells a person: before it starts, the data report (data_report), each rank's memory plan (memory_plan)
on its machines (hardware), whether it fits and the smallest mesh that would (fit_check), and micro-batches sized by
memory (micro_batches); throughput while it runs (telemetry), plots.png (plots), its wandb run (wandb_run), and how
the process maps its host memory (host_memory); after it, what evaluate.py reports (evaluation_report) and the
results it adds to a model card (model_card)."""

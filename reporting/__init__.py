"""What a run tells a person: the data report and memory plan before it starts (report), throughput while it runs
(telemetry), plots.png (plots), and how the process maps its host memory (host_memory)."""

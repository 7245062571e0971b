"""Preference pairs before the pipeline reads them: the pair types and the parser of each data format, from one row
to its pairs (formats), how conversational rows become text with the tokenizer's chat template (chat_templates), and
the rows of a dataset's files, directories and Hub datasets (sources). preference_datasets.py reads these sources
into pairs; nothing here imports it."""

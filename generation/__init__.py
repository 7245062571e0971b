"""Generation: completions drawn from a model and scored. Rows' completions sampled from seeds of their own, sharded
over the ranks (sampling), each batch decoded by our own loop (decoding) whose every token is one seeded draw
(seeded_draw), or handed to an OpenAI-compatible server (server_sampling); many completions of few prompts scored
with each prompt computed once (prompt_groups). It reads core's layouts and scoring; no file is written here."""

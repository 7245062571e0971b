"""Benchmarks behind the README's performance statements: `python -m bench [FLAGS]` from the repository's root. Each
run is one campaign, whose configurations are measured in that one run on one machine and printed side by side (the
ones that compete alternating, each in a fresh process), so that a comparison never rests on numbers from two runs.
One module per campaign:

- kernels.py (no flag): matmul throughput by dtype on this device (which decides the dtype advice for CPUs); float32
  sequence log-probs from bf16 logits, the chunked implementation against the naive full upcast, forward + backward
  at a SmolLM2-sized vocabulary.
- levers.py: --levers: the speed levers of the training step, each alone and all together, against the padded
  float32 path: SmolLM2-135M-Instruct on the first 48 pairs of ../shared's HH harmless-base file, DPO with beta 0.1
  and AdamW, at max_length 256 x 4 pairs and 512 x 8 pairs per step. Each configuration runs in a fresh process (so
  its peak RSS is its own), configurations alternate, and each prints pairs/s, real tokens/s (prompt counted once),
  MFU and peak memory. Then the peak memory of the log-prob computation at a 32k and a 128k vocabulary (kernels.py).
  --compile: compile_blocks=true (torch.compile of each transformer block) against eager, on the default
  configuration at 256 x 4, first step (compilation) and steady state. --lora: LoRA (the preset, rank 16 on every
  linear layer) against full fine-tuning on the default configuration at 256 x 4: seconds per step and peak RSS,
  alternating, each in a fresh process.
- precision.py: --precision [--rounds N]: float32, bfloat16, float16 with dynamic loss scaling and FP8 (torchao's
  float8 layers; emulated on a CPU) on SmolLM2 and HH pairs at 128 x 2: pairs/s, peak RSS, each step's loss against
  float32's, the loss scale and its skipped steps; each in a fresh process, alternating.
- fsdp.py: --fsdp: FSDP1 (`FullyShardedDataParallel`) vs FSDP2 (`fully_shard`) on 2 processes (gloo on the CPU, NCCL
  with 2+ GPUs), both sharding per Llama block: training step time, and the largest parameter difference from one
  process training on the same batches (decides which FSDP FSDPTrainer uses). --fsdp-reduce: FSDP2's gradient error
  reducing in bfloat16 against float32, 2 and 4 processes.
- attention.py: --attention: the packed layout's attention bookkeeping per micro-batch, dense mask against block
  mask, at T = 1k, 4k, 16k and 32k; and the CPU's no-grad forward with each.
- gpu.py (campaign.py its stages' time limits and records, trl.py TRL's side): --gpu [--out DIR] [--budget S]: the
  GPU campaign for a 15-minute lease, each stage a process with a time limit, results as JSON and markdown in one
  folder (the cuda tests; background saves beside GPU steps; torch.profiler's top kernels and the device's gaps for
  the default configuration; ours padded, packed dense-mask and packed block-mask, TRL's DPOTrainer and TRL with
  Liger on a random ~1B Llama at 1024 x 8, 1024 x 64 and 4096 x 16: pairs/s, tokens/s, MFU, peak memory); --gpu
  --smoke runs it at tiny sizes on any device, as the test suite does.
- data.py: --data: prepared pairs/s on a first run and a rerun, and resident bytes per token, at about 5k, 50k and
  500k synthetic pairs, for 1 and 2 processes; the dry run on HH rows; the reference cache at a million pairs
  (--data --smoke: small sizes, as the test suite runs it).
- profile.py: --profile [OVERRIDES ...]: where a training step's CPU time goes (operations by self time, parts of the
  step by their whole time) for any configuration, the default's by default.
- versus.py: --versus GIT_REF [--rounds N]: this tree's training step against another version's, alternating fresh
  processes (2 rounds unless told): pairs/s, MFU, the share of the machine's fastest matmul rate, peak RSS.
- scale.py (and scale_ranks.py, each rank's side): --scale [--versus GIT_REF]: each rank's peak resident memory while
  it reads the model, trains, saves (checkpoint and export) and resumes, and the load, save and resume times, on 1, 2
  and 4 processes, for a random 286M Llama (hidden 1024, 20 layers, float32, AdamW; 2 steps of 4 HH pairs) and the
  same twice as deep; with --versus, another version's code on each configuration too, in turn (--scale --smoke: tiny
  sizes, as the test suite runs it).
- async_save.py: --async-save [--rounds N]: checkpoints written in the background (save_async=true) against
  synchronous ones: the 286M Llama of --scale on one process, 8 steps of 4 HH pairs with a checkpoint every 2,
  alternating fresh processes (2 rounds unless told): how long training stands still at a save, a step's time with
  and without a checkpoint being written, the loop's whole time (--async-save --smoke: tiny sizes, one round).
- long.py: --long: each rank's peak resident memory while it trains on one 8160-token pair a step at
  sequence_parallel_size = 1, 2 and 4 (FSDPTrainer on as many CPU processes, gloo; a random 8-layer, hidden-256
  Llama, float32, the dense mask), each size a fresh launch, beside the dry run's per-rank training estimate and its
  activations, which sequence parallelism divides by sp (--long --smoke: tiny sizes, as the test suite runs it).
- window.py: --window: a sliding-window model (a narrow Gemma 3: five 128-token-window layers to one global, and
  Gemma 2's final soft cap of 30) at max_length 512 x 8 HH pairs, the default configuration (packed rows with a
  windowed mask per layer type, the scored head soft-capping itself) against what such a model took before (padded
  rows, all logits) and packed with all logits: pairs/s, alternating fresh processes, 2 rounds.
- reward.py: --reward: reward modelling against TRL's RewardTrainer: SmolLM2-135M-Instruct with a one-output head on
  the first 48 HH harmless-base pairs that fit max_length 512, 8 pairs a step, the same optimizer settings, in
  float32 and in bfloat16 autocast: pairs/s, real tokens/s and peak RSS, alternating fresh processes, 2 rounds
  (--reward --smoke: one short round, as the test suite runs it).
- vision.py: --vision [--rounds N]: vision-language DPO against TRL's DPOTrainer on a random ~150M LLaVA (CLIP
  ViT-B/16's tower, frozen; a Llama of SmolLM2-135M's width and vocabulary with 10 layers), coloured-square pairs
  with HH-like text lengths at max_length 512 x 4 pairs, float32: ours packed with the cached and with a live
  reference, TRL padded with its live reference (1.16 precomputes none for images): pairs/s, peak RSS and the
  images each vision tower encodes per pair, alternating fresh processes, 2 rounds (--vision --smoke: a tiny LLaVA,
  one short round, as the test suite runs it).
- generate.py (generate_worker.py its worker, run from either version's code): --generate [--versus GIT_REF]
  [--rounds N]: evaluate.py's sampling (the Sampler) in tokens/s against plain model.generate(do_sample=True) on the
  same prompts and batches and against the bound of the precision probe's float32 matmul rate over a decode step's
  FLOPs; the seeded sampler's time per step; where an evaluation's time goes (prefill, decode, the rest of sampling,
  the KL's log-probs, judging by a reward model): SmolLM2-135M-Instruct, 32 HH prompts, batch 32, 64 new tokens
  (--generate --smoke: a random tiny Llama, as the test suite runs it).
- decode_profile.py: --generate --profile: where a decode step's CPU time goes, in float32 and in bfloat16 (the
  blocks' linears and the LM head with their rates against the probe's, attention, the seeded draw, other operations,
  Python), and the speed-up were only the linear layers left.

What they share: common.py (the HH workload and HH-like pairs, the machine's matmul rates, a worker in a fresh
process from this tree's code or another version's) and step.py (one configuration's training steps timed in a fresh
process: the worker of --levers, --compile, --lora, --window, --gpu, --reward, --vision and --versus). __main__.py
reads the flags.
"""

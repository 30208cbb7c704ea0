"""Will it fit, how fast, in rooms: each imports only from itself and the rooms above it here.

    model/   what the model is, sized offline: shapes.py (ModelShape from a known id or a config.json),
             vision_shapes.py (an image-text model's tower, projector and image tokens)
    memory/  how much memory: open estimate.py first (per GPU, host RAM, NVMe); its input, one
             configuration and the rules that refuse impossible ones, is inputs.py; its terms come from
             formulas.py, model_split.py, host.py, offload_buffers.py, quantized_bytes.py, generation.py;
             pinning.py (the pinned allocator and the memlock limit)
    speed/   how fast: open step_time.py first (the step-time model that ranks configurations); flops.py
             (FLOPs per token, shared with MFU), checkpoint_cost.py (a checkpoint's size and save time)
    search/  will it fit, and what would: candidate.py (one configuration evaluated: memory, speed,
             fits), fixes.py (the cheapest changes that make it fit), host_settings.py,
             long_context.py (the longest sequence that fits), guards.py (the checks before a run starts)
    report/  what `llm-train plan --recipe NAME` prints: verdict.py (the verdict, fixes and notes),
             vision_note.py
    auto/    which recipe `--recipe auto` writes: choose.py (the search and the pick), request.py (what
             it plans from, how candidates rank), knobs.py (the recipe keys it turns), reasons.py (the
             why lines), written.py (the recipe written, read back and checked)

The rule: a room is placed above everything it needs, so "how much memory" is answered in memory/ alone
and read by the rooms above it (tests/unit/test_layers.py PLANNING_ROOMS holds the order and fails an arrow
from a lower room to a higher one). This package itself holds no module: every name is imported from the
module of its room that defines it.
"""

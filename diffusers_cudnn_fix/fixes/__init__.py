"""The fix table: one record per upstream bug, plain data (no torch). Each record's check is ``check`` in
``fixes/<id>.py``; its policy is a step of its targets' replacements (``targets/``). The order is the
report's, nothing else. docs/adding-a-fix.md lists what a new fix needs."""

from __future__ import annotations

from .._fix import Fix
from .._switches import mask_mode
from .._target_names import (
    CUDNN_BACKWARD,
    CUDNN_FORWARD,
    ENABLE_PARALLELISM,
    FLASH_BACKEND,
    FLASH_BACKWARD,
    FLASH_FORWARD,
    GATHER_BACKWARD,
    QWEN_PROCESSOR,
    RESOLVE_PARALLEL_CONFIG,
    RING_BACKWARD,
    RING_FORWARD,
    ULYSSES_ANYTHING_FORWARD,
    ULYSSES_BACKWARD,
    ULYSSES_FORWARD,
)

PR_14274 = "https://github.com/huggingface/diffusers/pull/14274"

#: Where cp_split_warning_once's bug lies (not a target: the package replaces nothing there); what ``verify
#: --without-package`` watches for it (``Fix.bug_in``).
SPLIT_HOOK_PREPARE = "diffusers.hooks.context_parallel:ContextParallelSplitHook._prepare_cp_input"

MODE_EFFECTS = {
    "convert": "bool masks become additive masks in q's dtype, other float masks are cast to it; a mask that "
    "only pads keys runs the kernel on the valid keys alone",
    "warn": "bool and wrongly typed masks are passed through as diffusers does: the kernel misreads them "
    "(a bool mask is read out of bounds)",
    "error": "bool and wrongly typed masks raise UnsafeAttentionError",
}


def _mask_note() -> str:
    mode = mask_mode()
    return f"mask mode {mode}: {MODE_EFFECTS[mode]}"


#: What an upstream folder (``upstream/<id>/``) holds, for the doctor's pointer to it (Fix.upstream_issue).
PATCH_FOR_DIFFUSERS = "reproducer, fix.patch, test"

#: The verify runs that reach the policies (Fix.reached_by): the options, and GPUs where the backend's kernel has no
#: CPU implementation.
CUDNN_RUN = "verify --backend _native_cudnn (on GPUs)"
CUDNN_MASK_RUN = "verify --backend _native_cudnn --model qwen --mask padded (on GPUs)"
FLASH_RUN = "verify --backend _native_flash (on GPUs)"
QWEN_MASK_RUN = "verify --model qwen --mask padded (on a CPU too)"
MASKS = "attention masks"
#: Where no verify run reaches a policy: its models, Flux and QwenImage, attend with one length and one-head masks.
LTX_MASK_RUN = "verify --model ltx --mask padded (on a CPU too)"

#: Fix(id, title, upstream, affected releases, targets, kind="correction", note, only_for_on, old_ids, upstream_issue,
#: matters_to, reached_by, bug_in, reached_when)
ALL_FIXES: tuple[Fix, ...] = (
    Fix("cudnn_forward_lse", "cuDNN forward op computes no log-sum-exp on the context-parallel training path",
        PR_14274, ">=0.36.0,<0.40.0", (CUDNN_FORWARD,), reached_by=CUDNN_RUN),
    Fix("cudnn_backward_kv", "cuDNN backward op transposes the saved K/V a second time",
        PR_14274, ">=0.36.0,<0.40.0", (CUDNN_BACKWARD,), reached_by=CUDNN_RUN),
    Fix("flash_backward_kv", "native-flash backward op transposes the saved K/V a second time",
        PR_14274, ">=0.37.0,<0.40.0", (FLASH_BACKWARD,), reached_by=FLASH_RUN),
    Fix("ulysses_grad_count", "Ulysses backward returns one gradient fewer than the forward has inputs",
        PR_14274, ">=0.36.0,<0.37.0", (ULYSSES_BACKWARD,),
        reached_by=CUDNN_RUN),
    Fix("ulysses_mask_grad", "Ulysses context parallelism gives a mask that requires grad no gradient, silently",
        "not reported upstream as of diffusers 0.42.1", ">=0.36.0", (ULYSSES_FORWARD,), "guard",
        upstream_issue=PATCH_FOR_DIFFUSERS, matters_to=MASKS, reached_by=QWEN_MASK_RUN, reached_when="never"),
    Fix("cudnn_bool_mask", "bool or wrongly typed attention masks are read as an additive bias by the cuDNN CP op",
        "https://github.com/huggingface/diffusers/issues/14342", ">=0.36.0",
        (CUDNN_FORWARD, ULYSSES_FORWARD, ULYSSES_ANYTHING_FORWARD), "guard",
        note=_mask_note, upstream_issue=f"{PATCH_FOR_DIFFUSERS}; huggingface/diffusers#14342", matters_to=MASKS,
        reached_by=CUDNN_MASK_RUN, bug_in=(CUDNN_FORWARD,), reached_when="mask"),
    Fix("cudnn_input_dtypes", "fp32 or mixed-dtype q/k/v are accepted by the raw cuDNN op and give garbage",
        "none filed yet: aten::_scaled_dot_product_cudnn_attention checks no dtype", ">=0.36.0", (CUDNN_FORWARD,),
        "guard", old_ids=("cudnn_fp32_inputs",), upstream_issue=PATCH_FOR_DIFFUSERS,
        matters_to="fp32 or mixed-dtype q/k/v", reached_by=CUDNN_RUN, reached_when="never"),
    Fix("cudnn_masked_row_grads",
        "cuDNN's backward gets fully masked query rows wrong when there is one key/value position",
        "none known: a fault of aten::_scaled_dot_product_cudnn_attention_backward (cuDNN 9.19)", ">=0.36.0",
        (CUDNN_BACKWARD,), "guard",
        upstream_issue="a cuDNN kernel fault: its PyTorch-level reproducer, and fix.patch, the workaround diffusers "
        "could carry", matters_to=MASKS, reached_by=CUDNN_MASK_RUN, reached_when="never"),
    Fix("flash_cp_ignored",
        "0.36.0's _native_flash backend ignores context parallelism: each rank attends to its own shard, silently",
        "not reported upstream; 0.37.0 runs the backend through context-parallel attention", ">=0.36.0,<0.37.0",
        (FLASH_BACKEND,), "guard",
        matters_to="_native_flash set after enable_parallelism", reached_by=FLASH_RUN, reached_when="never"),
    Fix("flash_input_alignment",
        "the native-flash CP forward hands the flash kernel q/k/v off 16 bytes (misaligned address on a GPU)",
        "not reported upstream as of diffusers 0.42.1", ">=0.37.0", (FLASH_FORWARD,), "guard",
        upstream_issue=PATCH_FOR_DIFFUSERS, matters_to="native flash with one head or token per rank",
        reached_by=FLASH_RUN, reached_when="never"),
    Fix("qwen_joint_mask_order",
        "QwenImage's joint mask meets Ulysses' K/V in another token order: padded prompts train wrong",
        "fixed in diffusers 0.39.0 (the plan shards the mask; Ulysses all-gathers it)", ">=0.36.0,<0.39.0",
        (ULYSSES_FORWARD, ULYSSES_ANYTHING_FORWARD, QWEN_PROCESSOR), reached_by=QWEN_MASK_RUN,
        bug_in=(ULYSSES_FORWARD, ULYSSES_ANYTHING_FORWARD), reached_when="mask"),
    Fix("ring_grad_route", "ring/unified context parallelism's backward gives wrong K/V gradients: every ring step "
        "reuses the first step's tensors (0.36-0.39), or the gradients go the wrong way round from ring degree 3",
        f"{PR_14274} fixed the first; the route is not reported upstream", ">=0.36.0", (RING_FORWARD, RING_BACKWARD),
        only_for_on=(">=0.40.0", "ring attention at ring_degree >= 3, or with a mask or dropout"),
        old_ids=("ring_backward",), upstream_issue=PATCH_FOR_DIFFUSERS, bug_in=(RING_BACKWARD,),
        reached_by="verify --ring 2 --backend _native_cudnn (on GPUs; ring degree 3 or more for 0.40's route)"),
    Fix("ulysses_head_mask", "Ulysses attention hands the op a per-head mask with every head, where q holds the "
        "rank's heads alone: LTX and LTX2 with their text mask fail", "not reported upstream as of diffusers 0.42.1",
        ">=0.36.0", (ULYSSES_FORWARD,), only_for_on=(">=0.36.0", "Ulysses attention with a per-head mask (LTX, LTX2)"),
        upstream_issue=PATCH_FOR_DIFFUSERS, reached_by=LTX_MASK_RUN, reached_when="never"),
    Fix("ulysses_kv_length", "Ulysses backward reshapes dK/dV with the queries' length: cross-attention to keys of "
        "another length fails", "not reported upstream as of diffusers 0.42.1", ">=0.36.0", (ULYSSES_BACKWARD,),
        only_for_on=(">=0.36.0", "Ulysses training with keys of another length than the queries (LTX, LTX2)"),
        upstream_issue=PATCH_FOR_DIFFUSERS, reached_by=LTX_MASK_RUN, reached_when="never"),
    Fix("cp_gather_grads", "a context-parallel plan that gathers inside the model (Helios) gives the parameters run "
        "replicated between its split/gather pairs wrong gradients, silently", "not reported upstream as of "
        "diffusers 0.42.1", ">=0.36.0", (ENABLE_PARALLELISM,),
        only_for_on=(">=0.36.0", "context-parallel training of a model whose plan gathers inside it (Helios)"),
        upstream_issue=PATCH_FOR_DIFFUSERS, reached_by="verify --model helios (on a CPU too)",
        bug_in=(GATHER_BACKWARD,), reached_when="never"),
    Fix("ltx2_cp_plan", "LTX2's context-parallel plan splits rope but not cross_attn_rope and never shards the audio "
        "stream: its audio-video cross-attention fails", "not reported upstream as of diffusers 0.42.1", ">=0.37.0",
        (ENABLE_PARALLELISM,), only_for_on=(">=0.37.0", "context parallelism of LTX2"),
        upstream_issue=PATCH_FOR_DIFFUSERS, reached_by="verify --model ltx2 (on a CPU too)", reached_when="never"),
    Fix("cp_split_warning_once", "diffusers' context-parallel split hook calls logger.warning_once, which diffusers' "
        "logger has only once transformers is imported: an input of other dims than the plan's (Wan's 1-D timestep) "
        "raises AttributeError", "not reported upstream as of diffusers 0.42.1", ">=0.36.0", (ENABLE_PARALLELISM,),
        only_for_on=(">=0.36.0", "context parallelism without transformers imported, with an input of other dims "
                     "than the plan's (Wan's 1-D timestep)"),
        upstream_issue=PATCH_FOR_DIFFUSERS, reached_by="verify --model ltx2 (on a CPU too)",
        bug_in=(SPLIT_HOOK_PREPARE,), reached_when="never", environment="transformers not imported"),
    Fix("cp_no_accelerator", "diffusers 0.42's context parallelism divides the rank by the accelerator count, 0 on a "
        "CPU-only torch: enable_parallelism raises ZeroDivisionError", "not reported upstream as of diffusers 0.42.1",
        ">=0.42.0", (RESOLVE_PARALLEL_CONFIG,),
        only_for_on=(">=0.42.0", "context parallelism on a CPU-only torch (gloo)"),
        upstream_issue=PATCH_FOR_DIFFUSERS, reached_by="verify --nproc 2 (on a CPU)"),
)  # fmt: skip

"""The attributes of ``diffusers.models.attention_dispatch`` the fixes may replace, named once. Plain strings,
no imports: the package's root reads them at import (:data:`TARGETS`), the fix table and the replacements too.

A target is an attribute of the module (``name``), of a class there (``Class.attr``), or an entry of a dict there
(``Class.attr[key]``: the backend registry's, which diffusers' dispatch reads at every call). A target of another
module names it first, ``module:Class.attr``: found through ``sys.modules``, patched once that module is imported."""

CUDNN_FORWARD = "_cudnn_attention_forward_op"
CUDNN_BACKWARD = "_cudnn_attention_backward_op"
FLASH_FORWARD = "_native_flash_attention_forward_op"
FLASH_BACKWARD = "_native_flash_attention_backward_op"
#: diffusers' ring attention class (0.36+), whose forward and backward the package replaces.
RING_CLASS = "TemplatedRingAttention"
RING_FORWARD = f"{RING_CLASS}.forward"
RING_BACKWARD = f"{RING_CLASS}.backward"
ULYSSES_FORWARD = "TemplatedUlyssesAttention.forward"
ULYSSES_BACKWARD = "TemplatedUlyssesAttention.backward"
ULYSSES_ANYTHING_FORWARD = "TemplatedUlyssesAnythingAttention.forward"
#: The ``_native_flash`` backend as diffusers' dispatch reaches it: its entry in the backend registry.
FLASH_BACKEND = "_AttentionBackendRegistry._backends[_native_flash]"
#: QwenImage's attention processor, which knows the text length its joint mask needs (qwen_joint_mask_order).
QWEN_PROCESSOR = "diffusers.models.transformers.transformer_qwenimage:QwenDoubleStreamAttnProcessor2_0.__call__"
#: diffusers' entry to context parallelism for a model, which applies its plan (cp_gather_grads refuses training where
#: the plan gathers inside the model).
ENABLE_PARALLELISM = "diffusers.models.modeling_utils:ModelMixin.enable_parallelism"
#: Where diffusers 0.42 computes a rank's device (cp_no_accelerator), for enable_parallelism and from_pretrained.
RESOLVE_PARALLEL_CONFIG = "diffusers.models.modeling_utils:ModelMixin._resolve_parallel_config"
#: Modules of targets that the hook imports, where they are not yet, before it checks diffusers' attention module:
#: every model imports them anyway, and a check must not find its target missing only because of the import order.
IMPORTED_FIRST = (ENABLE_PARALLELISM.partition(":")[0],)
#: Where cp_gather_grads' bug lies (not a target: the package replaces nothing there); what ``verify
#: --without-package`` watches for it (``Fix.bug_in``).
GATHER_BACKWARD = "diffusers.hooks.context_parallel:AllGatherFunction.backward"

#: diffusers' entry from the attention dispatch into context parallelism (not a target): the checks of
#: ulysses_mask_grad and flash_cp_ignored run the code that calls it with a stand-in there.
TEMPLATED_ATTENTION = "_templated_context_parallel_attention"

#: Every target, in the order of the public :data:`diffusers_cudnn_fix.TARGETS`.
TARGETS = (
    CUDNN_FORWARD, CUDNN_BACKWARD, FLASH_FORWARD, FLASH_BACKWARD, RING_FORWARD, RING_BACKWARD, ULYSSES_FORWARD,
    ULYSSES_BACKWARD, ULYSSES_ANYTHING_FORWARD, FLASH_BACKEND, QWEN_PROCESSOR, ENABLE_PARALLELISM,
    RESOLVE_PARALLEL_CONFIG,
)  # fmt: skip

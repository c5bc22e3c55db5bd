"""One file per architecture; importing this package registers them all."""
from mawforge.models import gemma4, mixtral, olmoe, qwen2moe, qwen35moe, qwen3moe  # noqa: F401
from mawforge.models import deepseek2, gptoss, qwen3next  # noqa: F401
from mawforge.models.base import MoETransformer


def model_class(arch: str) -> type[MoETransformer]:
    return MoETransformer.registry[arch]

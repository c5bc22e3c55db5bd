"""One file per architecture; importing this package registers them all."""
from mawforge.models import mixtral, olmoe, qwen2moe, qwen3moe  # noqa: F401
from mawforge.models.base import MoETransformer


def model_class(arch: str) -> type[MoETransformer]:
    return MoETransformer.registry[arch]

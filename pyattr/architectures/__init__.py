"""The architecture table (:mod:`pyattr.architectures.table`) and where its roles are in a
model instance (:mod:`pyattr.architectures.paths`): what every method reads to find
embeddings, blocks, norms, attention and MLP parts, heads and position conventions."""

from pyattr.architectures.paths import (  # noqa: F401
    WRAPPER_PREFIX,
    base_prefix,
    get_submodule,
    join,
    layer_paths,
    model_type,
)
from pyattr.architectures.table import (  # noqa: F401
    ARCHITECTURES,
    FUSED_GATED_FORMS,
    MODERNBERT_MLP,
    PHI3_MLP,
    VISION,
    Arch,
    FusedGatedForm,
)

"""The architecture table (:mod:`pyattr.architectures.table`) and where its roles are in a
model instance (:mod:`pyattr.architectures.paths`): what every method reads to find
embeddings, blocks, norms, attention and MLP parts, heads and position conventions. For a
model the table does not map, structural discovery (:mod:`pyattr.architectures.discover`,
opted into with ``generic=True``) reads the same kind of entry off its module graph;
:func:`arch_of` is the entry a method reads either way."""

from pyattr.architectures.paths import (  # noqa: F401
    WRAPPER_PREFIX,
    base_prefix,
    get_submodule,
    input_embeddings,
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
from pyattr.architectures.seq2seq import (  # noqa: F401
    CLASSIFIER_HEADS,
    SEQ2SEQ,
    Seq2Seq,
    classifier_head,
    one_stack,
    refuse_one_forward_of_steps,
    refuse_padded_streams,
    streams_decoder,
)
from pyattr.architectures.discover import arch_of, discover, padding_idx_embeddings, require  # noqa: F401, I001 - after the table it reads

"""Models behind the cache: the interface an engine needs (`PagedModel`), the embedded
reference hybrid model (F / S / M / H / - layers) and its no-cache oracle, and real
checkpoints (`model.hf`)."""
from .base import PagedModel, ReferenceModel
from .config import LAYER_KINDS, PRESETS, HybridConfig, preset
from .loading import load_model
from .fingerprint import file_fingerprint, model_witness, weights_fingerprint, weights_witness
from .paged import PagedInput, paged_forward
from .reference import reference_forward
from .tokenizer import ByteTokenizer
from .weights import init_weights, load_weights, save_weights

__all__ = ["LAYER_KINDS", "PRESETS", "HybridConfig", "preset", "reference_forward", "ByteTokenizer",
           "init_weights", "save_weights", "load_weights", "PagedInput", "paged_forward", "weights_fingerprint",
           "file_fingerprint", "weights_witness", "model_witness", "PagedModel", "ReferenceModel", "load_model"]

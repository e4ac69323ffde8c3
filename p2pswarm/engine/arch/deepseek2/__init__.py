"""deepseek2 (DeepSeek-V2/V3/R1, Kimi K2): Multi-head Latent Attention, leading dense FFN layers, a
shared expert, softmax or sigmoid+bias group-limited routing; NextN blocks are the MTP drafter's
(:mod:`p2pswarm.backbone.serving.mtp`, which keeps a :class:`.mla.LatentCache` of its own). Its numpy dense
path is :mod:`.model`, MLA in numpy :mod:`.mla`, a whole MLA layer as one ggml graph
:mod:`.ggml_mla`; its make-model presets are :mod:`p2pswarm.model.synth_deepseek2` (the model
layer: make-model writes files without the engine)."""
from p2pswarm.engine.arch.deepseek2.model import DeepSeek2

__all__ = ["DeepSeek2"]

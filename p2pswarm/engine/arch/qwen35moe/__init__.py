"""qwen35moe (Qwen3.5 MoE): Gated DeltaNet layers with every ``full_attention_interval``-th layer
gated full attention (IMROPE), routed experts and a sigmoid-gated shared expert; the model's
recurrent state per sequence (:class:`.deltanet.DeltaNetState`). Its numpy dense path is
:mod:`.model`, Gated DeltaNet in numpy :mod:`.deltanet`; on the ggml kernel the delta rule alone
:mod:`.ggml_deltanet`, a whole DeltaNet layer as one graph :mod:`.deltanet_graph`, an attention
layer as one graph :mod:`.graph`. Its make-model presets are :mod:`p2pswarm.model.synth_qwen35moe`
(the model layer: make-model writes files without the engine)."""
from p2pswarm.engine.arch.qwen35moe.model import Qwen35MoE

__all__ = ["Qwen35MoE"]

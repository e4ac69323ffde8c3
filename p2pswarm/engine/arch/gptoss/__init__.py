"""gpt-oss (gpt-oss-20b, gpt-oss-120b): attention with biases and sinks, a sliding window on
alternate layers, YaRN RoPE, a biased router with softmax over the selected top-k, experts with
biases and swiglu_oai (:mod:`p2pswarm.engine.experts.expert_fn`). Its numpy dense path is :mod:`.model`,
its attention layer as one ggml graph :mod:`.graph`; its make-model presets are
:mod:`p2pswarm.model.synth_gptoss` (the model layer: make-model writes files without the engine)."""
from p2pswarm.engine.arch.gptoss.model import GptOss

__all__ = ["GptOss"]

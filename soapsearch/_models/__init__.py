"""Plain-PyTorch model definitions behind :mod:`soapsearch.zoo`."""

from .cnn import AlexNet, AlexNetConfig, InceptionConfig, InceptionV3, ResNet, ResNetConfig
from .rnn import NMT, RNNLM, RNNTC, LSTMStack, NMTConfig, RNNLMConfig, RNNTCConfig
from .transformer import GPT, MLP, GPTConfig, MLPConfig
from .llama import Llama, LlamaConfig

__all__ = [
    "AlexNet",
    "AlexNetConfig",
    "InceptionV3",
    "InceptionConfig",
    "ResNet",
    "ResNetConfig",
    "RNNTC",
    "RNNTCConfig",
    "RNNLM",
    "RNNLMConfig",
    "NMT",
    "NMTConfig",
    "LSTMStack",
    "MLP",
    "MLPConfig",
    "GPT",
    "GPTConfig",
    "Llama",
    "LlamaConfig",
]

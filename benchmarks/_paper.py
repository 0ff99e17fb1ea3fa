"""A zoo model at paper scale for a cluster: built on the meta device with the zoo's batch per
device (FlexFlow's 64; 1 sequence for GPT-3's shapes and LLaMA) times the device count, and
traced."""

from __future__ import annotations

from soapsearch import trace, zoo
from strategies import OpGraph


def paper_graph(name: str, num_devices: int, variant: str = "default") -> OpGraph:
    model, inputs = zoo.build(name, variant, device="meta")
    batch = inputs[0].shape[0] * num_devices
    model, inputs = zoo.build(name, variant, device="meta", batch_size=batch)
    return trace(model, inputs, name=name if variant == "default" else variant)

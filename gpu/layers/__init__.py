"""The model's layers: linear (tensor-parallel), rotary embeddings, attention, MoE, pooling."""

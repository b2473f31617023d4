"""Variational autoencoders (latents <-> pixels) with spatially sharded (patch-parallel) decoding."""

"""The torch training shim: elastic session, forward-layer checkpoints, the store and the sampler."""

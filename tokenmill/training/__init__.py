"""Offline tools that train or build what speculative decoding loads: an EAGLE draft head (eagle.py), Medusa
heads (medusa.py) and the n-gram proposer's datastore of the target's own answers (datastore.py); the
`tokenmill train-eagle`, `train-medusa` and `build-datastore` commands.

They are built on the public `tokenmill.LLM` API (the target answers prompts through the engine like any user)
and read the runtime's head and datastore formats; the dependency runs one way only: the runtime packages
(spec_decode/, engine/, worker/, ...) never import from here, so serving never loads training code.
"""

"""Training data: token shards and their manifest (token_shards.py), the host's gs:// shard cache
(shard_cache.py), and the training order and loaders (loader.py: TrainLoader, val_batches).

Imports no other part of train/.
"""

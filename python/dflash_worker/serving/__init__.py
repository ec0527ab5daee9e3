"""Running an export in serving engines.

`serving.engines` checks an export and its target against what vLLM, SGLang, MLX and llama.cpp run and
writes how each serves it (`dflash-worker export --for ENGINE`); `serving.fields` says where each engine
reads each `config.json` field and completes an export's config so every engine finds them.

`serving.mlx` loads the BF16 and AF4G64 exports into MLX; it is imported only on demand, since it
imports MLX, mlx-lm and z-lab's `dflash`, which nothing else in `dflash_worker` needs.
"""

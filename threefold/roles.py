"""Parameter roles (compiler/param_roles.py decides them, the manifest stores them, the
training loop's weight decay reads them): neutral names, importable by the runtime side."""
MATMUL = "matmul"          # a matrix operand of a matmul-like op: decayed
EMBEDDING = "embedding"    # an embedding table (also tied to a head): decayed only if asked
OTHER = "other"            # norms, biases, gates, position tables: never decayed

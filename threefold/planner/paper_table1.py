"""Table 1 of Narayanan et al. (SC'21): the ten GPT runs the planner is validated against.

Each row: parameters (billions), attention heads, hidden size, layers, tensor-parallel size,
pipeline-parallel size, GPUs, global batch size, achieved TFLOP/s per GPU. Sequence length
2048 and vocabulary 51200 throughout; A100-80GB GPUs in DGX nodes of 8.
"""
TABLE1 = [
    (1.7, 24, 2304, 24, 1, 1, 32, 512, 137),
    (3.6, 32, 3072, 30, 2, 1, 64, 512, 138),
    (7.5, 32, 4096, 36, 4, 1, 128, 512, 142),
    (18.4, 48, 6144, 40, 8, 1, 256, 1024, 135),
    (39.1, 64, 8192, 48, 8, 2, 512, 1536, 138),
    (76.1, 80, 10240, 60, 8, 4, 1024, 1792, 140),
    (145.6, 96, 12288, 80, 8, 8, 1536, 2304, 148),
    (310.1, 128, 16384, 96, 8, 16, 1920, 2160, 155),
    (529.6, 128, 20480, 105, 8, 35, 2520, 2520, 163),
    (1008.0, 160, 25600, 128, 8, 64, 3072, 3072, 163),
]
SEQ = 2048
VOCAB = 51200

# The paper's text (sec. 5.1): GPT-3 175B (96 layers, hidden 12288, 96 heads) trained on 1024
# A100s at batch 1536 ran at 140 TFLOP/s per GPU. The text gives no (t, p): t=8 as in every
# row from 18B up, p left to the planner (pp=None). Same layout as the rows above.
TEXT_175B = (175.0, 96, 12288, 96, 8, None, 1024, 1536, 140)
MEASURED_ROWS = TABLE1 + [TEXT_175B]

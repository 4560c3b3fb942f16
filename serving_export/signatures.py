"""Names of the exported models, their signatures, inputs and outputs (TF Serving's contract).

Plain constants, no TensorFlow: the SavedModel builder, the warmup requests, the sample
requests and the verification all take their names from here.
"""

import numpy as np

QUERY = "query"
CANDIDATE = "candidate"
RETRIEVAL = "retrieval"
MODEL_NAMES = (QUERY, CANDIDATE, RETRIEVAL)
SIGNATURE = "serving_default"
TF_EXAMPLE_SIGNATURE = "predict_tf_example"
SIGNATURES = (SIGNATURE, TF_EXAMPLE_SIGNATURE)
EMBEDDING = "embedding"
ITEM_IDS = "item_ids"
SCORES = "scores"
EXAMPLES = "examples"
K = "k"
USER_VOCAB_ASSET = "users.txt"
ITEM_VOCAB_ASSET = "items.txt"
PAD_ITEM_ID = ""
# Scores are dot products of L2-normalised vectors, in [-1, 1]: -2 sorts below every real
# score and, unlike -inf, is valid JSON in a TF Serving REST response. Unnormalised towers
# (`model.normalize: false`) have unbounded scores: they pad with the lowest float32.
PAD_SCORE = -2.0
UNNORMALIZED_PAD_SCORE = float(np.finfo(np.float32).min)

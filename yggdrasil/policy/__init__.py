"""The run-time side of calibration: everything a bundle needs to choose each iteration's bucket
(the constant policy, the depth predictor's inference, draft confidence, the cost models and the
device profile they read) behind runtime.policy.BucketPolicy. Calibration, training, judging and
plots live in predictor/, above the bundle."""

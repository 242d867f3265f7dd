"""Fallback and scoring: ``window_scores`` scores every emitted token and the ``<|nospeech|>``
probability inside the stage (plain and speculative runners) and turns a finished window into the
verdict temperature fallback acts on; ``metrics`` counts acceptance and fallbacks and serves them
as Prometheus text and JSON."""

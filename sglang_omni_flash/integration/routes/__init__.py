"""The HTTP side of the ASR server: ``transcriptions`` serves long files, the timestamped formats
(srt, vtt, verbose_json) and temperature fallback on the OpenAI audio routes; ``segments`` builds
verbose_json segments from the model's own timestamp tokens; ``openai_errors`` answers user
mistakes with the OpenAI error envelope (HTTP 4xx), never a traceback."""

"""The decode worker inside the ASR stage: ``runner.WhisperFlashModelRunner`` executes the round of
``flash.rounds`` (draft, verify, commit) over sglang's batch and KV pool; ``history`` keeps the
drafter's memories per request; ``verify`` runs the target over every verify block in one pass;
``cpu_model`` makes the stage's model row-invariant on a CPU (plain and speculative servers alike);
``timestamp_rows`` applies Whisper's timestamp rules to draft and verify rows; ``streaming`` streams
the several tokens a round emits."""

-- Blobs verified when read (docs/architecture.md, "Blobs verified when read"): where the
-- running pass of a long job (the scrub) has got to, so a pass cut off by a restart
-- resumes there instead of starting over.
ALTER TABLE job_runs ADD COLUMN cursor text;

-- Streaming across processes (docs/architecture.md, "Streaming across replicas"): the
-- holder of a fetch lease announces the temp file it is writing, with the answer's type
-- and length, so waiting processes serve it as it grows.
ALTER TABLE fetch_leases ADD COLUMN stream_file TEXT;
ALTER TABLE fetch_leases ADD COLUMN stream_type TEXT;
ALTER TABLE fetch_leases ADD COLUMN stream_length INTEGER;

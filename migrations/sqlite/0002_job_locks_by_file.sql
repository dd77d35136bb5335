-- Job locks on SQLite are now flock()s on files beside the database: like Postgres'
-- advisory session locks they die with the holder's process (the row with a 1-hour TTL
-- they replace could block a job for an hour after a crash).
DROP TABLE job_locks;

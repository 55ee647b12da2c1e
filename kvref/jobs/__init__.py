"""What users run, one module a job: restore and save, convert (retype, edit), check and its identity sidecar,
diff, tensors/export/plot, the conformance runner, and the command line over them (`kvref.jobs.cli`)."""

/** Per-test-file setup for integration tests: Temporal's worker logs only warnings and errors. */
import { DefaultLogger, Runtime } from '@temporalio/worker';

Runtime.install({ logger: new DefaultLogger('WARN') });

// Lint fixture: the Kubernetes room importing an activity (it sits below activities).
import { createKubernetesActivities } from '../../../../activities/kubernetes/activities';

export const make = createKubernetesActivities;

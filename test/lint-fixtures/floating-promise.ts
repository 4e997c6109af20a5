// Lint fixture: a promise nobody awaits is an error everywhere.
async function work(): Promise<number> {
  return Promise.resolve(1);
}

export function bad(): void {
  work();
}

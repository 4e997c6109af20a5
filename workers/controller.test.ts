/**
 * `magus controller`'s flags: the watched namespaces as a list (comma-separated or the flag
 * repeated, MAGUS_CONTROLLER_NAMESPACES without the flag), every name checked.
 */
import { parseControllerArgs } from './controller';

describe('magus controller --namespace', () => {
  const saved = process.env.MAGUS_CONTROLLER_NAMESPACES;
  afterEach(() => {
    if (saved === undefined) delete process.env.MAGUS_CONTROLLER_NAMESPACES;
    else process.env.MAGUS_CONTROLLER_NAMESPACES = saved;
  });

  test('none: every namespace', () => {
    delete process.env.MAGUS_CONTROLLER_NAMESPACES;
    expect(parseControllerArgs([]).namespaces).toEqual([]);
  });

  test('one, a comma-separated list, or the flag repeated; duplicates dropped', () => {
    expect(parseControllerArgs(['--namespace', 'models']).namespaces).toEqual(['models']);
    expect(parseControllerArgs(['--namespace', 'team-a, team-b']).namespaces).toEqual(['team-a', 'team-b']);
    expect(parseControllerArgs(['--namespace', 'team-a', '--namespace', 'team-b,team-a']).namespaces).toEqual(['team-a', 'team-b']);
  });

  test('MAGUS_CONTROLLER_NAMESPACES without the flag; the flag wins over it', () => {
    process.env.MAGUS_CONTROLLER_NAMESPACES = 'x,y';
    expect(parseControllerArgs([]).namespaces).toEqual(['x', 'y']);
    expect(parseControllerArgs(['--namespace', 'z']).namespaces).toEqual(['z']);
  });

  test('a name that is no namespace name, or an empty list, is refused naming it', () => {
    expect(() => parseControllerArgs(['--namespace', 'team-a,Team_B'])).toThrow('--namespace "Team_B" is not a namespace name');
    expect(() => parseControllerArgs(['--namespace', ' , '])).toThrow('--namespace " , " names no namespace');
    expect(() => parseControllerArgs(['--namespace'])).toThrow('--namespace needs a value');
    process.env.MAGUS_CONTROLLER_NAMESPACES = 'ok,-bad';
    expect(() => parseControllerArgs([])).toThrow('MAGUS_CONTROLLER_NAMESPACES: "-bad" is not a namespace name');
  });
});

"""The terminal environment: bash and file tools in a Debian sandbox, with procedural task families."""
